"""Transports: the last hop. One interface, declared capabilities, chosen by SENDONCE_TRANSPORT_URL."""
