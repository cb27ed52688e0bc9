"""The gateway: the OpenAI-compatible HTTP front of the engine (first and last stop
on the request's way). ``bus_client.py`` is its side of the bus, ``app.py`` the routes,
``http_endpoints.py`` the generation endpoints, ``uvicorn_runner.py`` the process that
runs both in one loop."""
