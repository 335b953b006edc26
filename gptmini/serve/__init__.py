"""Serving: the OpenAI-compatible app (app.py) over the engine's thread (engine_thread.py),
the request schema (schema.py), the page at / and its endpoints (page.py, web/), and the
`serve.py` command (command.py). Needs the serve extra (fastapi, uvicorn)."""
