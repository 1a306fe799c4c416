"""Receipt schema, canonical JSON and hashing, the chained log, replay and verification."""
