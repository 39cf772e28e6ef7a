"""The HTTP shell around the engine: an OpenAI-compatible server (``compress serve``). server.py builds the app from
the route modules in routes/; engine_loop.py steps the engine in one thread; serving.py turns a request into
engine work; openai_protocol.py and openai_responses.py are the wire shapes; metrics.py is /metrics."""
