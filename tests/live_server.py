"""A live OpenAI-compatible server for tests: uvicorn running the app on a free loopback port, in a thread."""
import socket
import threading
import time


class Served:
    """uvicorn running ``create_app(engine, config)`` on a free loopback port, in a thread."""

    def __init__(self, engine, **config):
        import uvicorn

        from runtime.server import ServerConfig, create_app

        self.engine, self.model = engine, config["model_name"]
        self.app = create_app(engine, ServerConfig(**config))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key="test-key"):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
