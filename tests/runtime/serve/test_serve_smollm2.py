"""The real SmolLM2 behind the server (slow): JSON-schema outputs parse and validate, and tool_choice "required"
returns a valid call, through the `openai` client; the prompt's logprobs equal the engine's direct scoring."""
import json

import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from runtime.config import EngineConfig  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from test_structured_output import SCHEMAS  # noqa: E402
from test_server import KEY, Served  # noqa: E402
from test_tool_calls import TIME, WEATHER  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = ["Describe a person as JSON.", "Give me a JSON record for a product."]
HERMES = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if tools %}<|im_start|>system\nCall one of: {% for t in tools %}{{ t.function.name }} {% endfor %}"
          "as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def served():
    engine = Engine(EngineConfig(model="smollm2-135m", max_model_len=1024, max_num_seqs=8))
    s = Served(engine, model_name="smollm2", api_key=KEY)
    yield s
    s.close()


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_on_smollm2(served, schema):
    c = served.client()
    for prompt in PROMPTS:
        r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=200,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "r", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_required_tool_call_on_smollm2(served):
    served.engine.tokenizer.chat_template = HERMES
    r = served.client().chat.completions.create(model="smollm2", max_tokens=120, tools=[WEATHER, TIME],
                                                tool_choice="required",
                                                messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
    call = r.choices[0].message.tool_calls[0]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), params)
