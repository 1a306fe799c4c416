"""The prompt: what the model is shown, token for token.

The scaffold and the prompt builder (``prompt``), the chat framing around the system
and user contents (``framing``), the conversation's turns (``conversation``), one
place per distinct chunk text (``slots``) and the order the slots are shown in
(``layout``).

Imports nothing of :mod:`app.answering` (the answer path lays prompts out through it)
nor of the interfaces (``app.api``, ``app.cli``, ``app.ui``).
"""
