"""The gateway: the OpenAI-compatible HTTP front of the engine (first and last stop
on the request's way). See ``service.py`` for the bus side and ``app.py`` for the routes."""
