"""The server's routes, one module per concern; ``ROUTERS`` is what the app includes, in this order."""
from runtime.serve.routes import chat, completions, ops, tokens

ROUTERS = (ops.router, tokens.router, completions.router, chat.router)
