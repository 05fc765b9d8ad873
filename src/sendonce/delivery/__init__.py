"""The one delivery pipeline: claim, compose, send, record. Every kind of mail goes through it."""
