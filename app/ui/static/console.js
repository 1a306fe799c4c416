// ragbudget console: small progressive enhancement. Every page works without this file.
// A form marked data-busy="label" shows that label and disables its button while the server works
// (a replay with regeneration, or planning, can take seconds).
"use strict";
document.addEventListener("submit", function (event) {
  var form = event.target;
  if (!(form instanceof HTMLFormElement) || !form.dataset.busy) { return; }
  var button = form.querySelector("button[type=submit]");
  if (!button) { return; }
  window.setTimeout(function () {
    button.disabled = true;
    button.textContent = form.dataset.busy;
    button.setAttribute("aria-busy", "true");
  }, 0);
});
