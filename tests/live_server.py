"""A live OpenAI-compatible server for tests: uvicorn running the app on a free loopback port, in a thread, and the
tiny chat model (character tokenizer, random Llama) the server and bench tests run."""
import socket
import threading
import time

import pytest
import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def char_tokenizer():
    """One token per ASCII character plus specials, built offline: every sampled token decodes to a whole
    character, so streamed text can be compared with transformers' decode exactly."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    tk = Tokenizer(models.WordLevel({c: i for i, c in enumerate(specials + chars)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=specials[0], eos_token=specials[2],
                                  pad_token=specials[0], unk_token=specials[3])
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = char_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256, initializer_range=0.2,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


class Served:
    """uvicorn running ``create_app(engine, config)`` on a free loopback port, in a thread."""

    def __init__(self, engine, **config):
        import uvicorn

        from runtime.serve.server import ServerConfig, create_app

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


def serve_folder(path, api_key: str, max_num_seqs: int = 8, kv_cache_memory: int = 32 << 20) -> Served:
    """The engine on the model folder ``path`` (context 256), served under the folder's name with ``api_key``."""
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    engine = Engine(EngineConfig(model=str(path), max_num_seqs=max_num_seqs, max_model_len=256,
                                 kv_cache_memory=kv_cache_memory))
    return Served(engine, model_name=str(path), api_key=api_key, max_num_seqs=max_num_seqs, max_queue=64)
