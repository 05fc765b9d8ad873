"""The HTTP API (FastAPI). ``create_app`` is the factory; its lifespan owns the connection pool."""
