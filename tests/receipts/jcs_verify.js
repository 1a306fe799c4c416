// Verify ragbudget receipts as an auditor in JavaScript would: RFC 8785 (JCS) with the
// `canonicalize` package (by an author of the RFC) and SHA-256 from node:crypto.
// usage: NODE_PATH=.node/node_modules node jcs_verify.js receipts.json
//   receipts.json: a JSON array of receipt bodies as served by GET /v1/receipts/{id} (.receipt)
// Prints one JSON line per receipt: {"id", "stored", "recomputed", "match", "unsafe_integers"}.
"use strict";
const fs = require("fs");
const crypto = require("crypto");
const canonicalize = require("canonicalize");

function unsafeIntegers(value, path, out) {
  if (typeof value === "number" && Number.isInteger(value) && !Number.isSafeInteger(value)) out.push(path);
  else if (Array.isArray(value)) value.forEach((v, i) => unsafeIntegers(v, `${path}[${i}]`, out));
  else if (value !== null && typeof value === "object")
    for (const [k, v] of Object.entries(value)) unsafeIntegers(v, `${path}.${k}`, out);
  return out;
}

for (const body of JSON.parse(fs.readFileSync(process.argv[2], "utf8"))) {
  const { hash, ...unhashed } = body;
  const recomputed = "sha256:" + crypto.createHash("sha256").update(canonicalize(unhashed), "utf8").digest("hex");
  console.log(JSON.stringify({ id: body.id, stored: hash, recomputed, match: recomputed === hash,
                               unsafe_integers: unsafeIntegers(body, "", []) }));
}
