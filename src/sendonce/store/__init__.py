"""The store: all SQL, migrations, the embedded server and the connection helpers."""
