"""Pure domain logic: states, job ids, address normalization, key derivation. No I/O here."""
