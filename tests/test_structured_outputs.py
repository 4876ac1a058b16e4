"""Structured outputs and tool calls: on a tiny random model whose vocabulary is bytes (so it
can spell JSON; its own output is noise, so only what the constraint guarantees is checked),
through the engine, the HTTP API and the official openai client, and on the default model."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig, ServerConfig
from tandem.core.constraint import Constraint
from tandem.server.routes import create_app
from tandem.server.state import build_state
from tiny_models import VOCAB, save_tiny

SCHEMAS = {
    "object": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["id", "tags"]}},
        "required": ["user"]},
    "anyOf": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"x": {"type": "boolean"}},
                                          "required": ["x"]}]},
}


def write_byte_tokenizer(directory) -> None:
    """A byte-level BPE vocabulary (GPT-2 style, 3 specials + 256 bytes + a few merges), smaller
    than the model's 384 logits: the rows past it are padding the grammar must mask."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = [("{", '"'), ('"', ":"), ('"', ","), ('"', "}"), ("t", "r"), ("tr", "u"), ("tru", "e")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    assert len(vocab) < VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("struct-llama")
    save_tiny("llama", d)
    write_byte_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), device="cpu", dtype="float32", max_model_len=512)


PROMPTS = ["hello there", "a longer prompt, to be different", "x"]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(llm, name):
    schema = SCHEMAS[name]
    params = [SamplingParams(max_tokens=120, temperature=t, seed=s, constraint=Constraint.json_schema(schema))
              for t, s in ((0, None), (1.0, 1), (1.0, 2))]
    for out in llm.generate(PROMPTS, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_regex_choice_and_grammar(llm):
    cases = [
        (Constraint("json_object"), lambda t: isinstance(json.loads(t), dict)),
        (Constraint("regex", r"[a-c]{3}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t)),
        (Constraint.choice(["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
        (Constraint("grammar", 'root ::= "(" [0-9]+ ("+" [0-9]+)? ")"'),
         lambda t: re.fullmatch(r"\([0-9]+(\+[0-9]+)?\)", t)),
        (Constraint("grammar", 'start: "A" B\nB: "b" | "bb"'), lambda t: t in ("Ab", "Abb")),
    ]
    for constraint, ok in cases:
        for seed in (1, 2):
            # max_tokens 200: a random model may run on in [0-9]+ or an object's strings for long
            out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=200, temperature=1.0, seed=seed,
                                                          constraint=constraint))[0]
            if constraint.kind == "json_object" and out.finish_reason == "length":
                continue  # an object's open string: still valid so far, cut by max_tokens
            assert out.finish_reason == "stop" and ok(out.text), (constraint, out.text)


def test_bad_constraint_is_refused_before_it_runs(llm):
    with pytest.raises(ValueError, match=r"prompts\[0\]: guided_regex: the regular expression could not be compiled"):
        llm.generate("hi", SamplingParams(constraint=Constraint("regex", "(", "guided_regex")))
    assert llm.engine.num_running == 0


def test_grammar_end_stops_even_with_ignore_eos(llm):
    params = SamplingParams(max_tokens=50, temperature=1.0, seed=3, ignore_eos=True, min_tokens=20,
                            constraint=Constraint.choice(["yes", "no"]))
    out = llm.generate(PROMPTS[1], params)[0]
    # the grammar wins over min_tokens and ignore_eos: the output is the choice and ends there
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and len(out.token_ids) <= 4


def test_padding_rows_are_never_sampled(llm, monkeypatch):
    vocab = llm.tokenizer.vocab_size
    assert vocab < VOCAB
    model = llm.engine.runner.model
    original = model.compute_logits

    def padding_wins(hidden):
        logits = original(hidden)
        logits[:, vocab:] = 1e4  # rows past the tokenizer: what an untrained padding row could hold
        return logits

    monkeypatch.setattr(model, "compute_logits", padding_wins)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0,
                                                  constraint=Constraint("regex", "[a-z]{5}")))[0]
    assert re.fullmatch("[a-z]{5}", out.text) and all(t < vocab for t in out.token_ids), out.token_ids


def test_mixed_batch_leaves_unconstrained_rows_unchanged(llm):
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(PROMPTS, plain)]
    constrained = SamplingParams(max_tokens=24, temperature=0, constraint=Constraint.json_schema(SCHEMAS["nested"]))
    outs = llm.generate(PROMPTS + PROMPTS, [plain] * 3 + [constrained] * 3)
    assert [o.token_ids for o in outs[:3]] == alone
    for o in outs[3:]:
        assert o.finish_reason == "length" or jsonschema.validate(json.loads(o.text), SCHEMAS["nested"]) is None


def test_preemption_keeps_the_constraint(model_dir, llm):
    # 20 blocks of 4 tokens cannot hold the batch: requests are preempted and recomputed
    prompts = ["hello there", "x", "abc"] * 2
    small = LLM(model=str(model_dir), device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=20,
                block_size=4, policy="chunked", max_num_batched_tokens=16)
    schema = SCHEMAS["object"]
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=5, constraint=Constraint.json_schema(schema))
    outs = small.generate(prompts, params)
    assert sum(o.timing.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, params)]
    for o in outs:
        jsonschema.validate(json.loads(o.text), schema)


def test_step_retry_does_not_advance_the_grammar_twice(llm):
    """A step that failed after drawing: its tokens are dropped and drawn again (the engine
    retries it in halves); each matcher is rolled back to its request's own count rather than fed
    the token twice, so the outputs are those of a run without the failure."""
    from tandem.runner.grammar_matchers import GrammarMatchers

    matchers: GrammarMatchers = llm.engine.runner.sampler.grammars
    original = matchers.accept
    calls = {"n": 0}

    def accept_then_drop(request_ids, tokens):
        original(request_ids, tokens)
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated failure after drawing")

    matchers.accept = accept_then_drop  # type: ignore[method-assign]
    try:
        params = SamplingParams(max_tokens=40, temperature=0,  # greedy: the retried draw is the same
                                constraint=Constraint.json_schema(SCHEMAS["nested"]))
        outs = llm.generate(PROMPTS[:2], params)
    finally:
        matchers.accept = original  # type: ignore[method-assign]
    assert calls["n"] > 3
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(PROMPTS[:2], params)]
    assert all(o.finish_reason == "stop" for o in outs)


# --- the HTTP API -------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 7}},
    "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=5)
    age: int = pydantic.Field(ge=0, le=99)


@pytest.fixture
def state(model_dir):  # an engine loop starts once: a state per test
    config = EngineConfig.from_kwargs(model=str(model_dir), dtype="float32", num_kv_blocks=256, block_size=4,
                                      max_num_seqs=4)
    return build_state(config, ServerConfig(peak_flops=1e11, peak_memory_bandwidth=1e10))


def run_app(state, scenario):
    async def main():
        app = create_app(state)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000",
                                         timeout=60) as http:
                client = openai.AsyncOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x", http_client=http,
                                            max_retries=0)
                await scenario(http, client)

    asyncio.run(main())


MSGS = [{"role": "user", "content": "what is the weather?"}]


def test_tool_calls_named_and_required(state):
    async def scenario(http, client):
        named = await client.chat.completions.create(
            model=state.model_name, messages=MSGS, tools=[WEATHER, TIME], max_tokens=60, temperature=1.0, seed=1,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = named.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

        for parallel in (True, False):
            req = await client.chat.completions.create(
                model=state.model_name, messages=MSGS, tools=[WEATHER, TIME], tool_choice="required", max_tokens=150,
                temperature=1.0, seed=2, parallel_tool_calls=parallel)
            calls = req.choices[0].message.tool_calls
            assert req.choices[0].finish_reason == "tool_calls" and calls and (parallel or len(calls) == 1)
            tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
            for c in calls:
                jsonschema.validate(json.loads(c.function.arguments), tools[c.function.name])

        none = await client.chat.completions.create(model=state.model_name, messages=MSGS, tools=[WEATHER],
                                                    tool_choice="none", max_tokens=3)
        assert none.choices[0].message.tool_calls is None and none.choices[0].message.content is not None

        auto = await http.post("/v1/chat/completions", json={"messages": MSGS, "tools": [WEATHER]})
        assert auto.status_code == 400 and auto.json()["error"]["param"] == "tool_choice"
        assert "chat template" in auto.json()["error"]["message"]

    run_app(state, scenario)


def test_tool_calls_stream_like_openai(state):
    async def scenario(http, client):
        for choice_arg in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            stream = await client.chat.completions.create(
                model=state.model_name, messages=MSGS, tools=[WEATHER, TIME], tool_choice=choice_arg,
                max_tokens=150, temperature=1.0, seed=4, stream=True)
            calls: dict[int, dict] = {}
            reasons = []
            async for chunk in stream:
                for ch in chunk.choices:
                    assert ch.delta.content in (None, "")
                    for d in ch.delta.tool_calls or []:
                        entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                        if d.id:
                            assert entry["id"] is None and d.function.name
                            entry["id"], entry["name"] = d.id, d.function.name
                        entry["arguments"] += d.function.arguments or ""
                    if ch.finish_reason:
                        reasons.append(ch.finish_reason)
            assert reasons == ["tool_calls"] and calls
            params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
            for entry in calls.values():
                assert entry["id"].startswith("call_")
                jsonschema.validate(json.loads(entry["arguments"]), params[entry["name"]])

    run_app(state, scenario)


def test_openai_parse_helpers(state):
    async def scenario(http, client):
        parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
        parsed = await parse(model=state.model_name, messages=MSGS, response_format=Person, max_tokens=60,
                             temperature=1.0, seed=7)
        person = parsed.choices[0].message.parsed
        assert isinstance(person, Person) and 0 <= person.age <= 99

        tool = openai.pydantic_function_tool(Person, name="record_person")
        parsed = await parse(model=state.model_name, messages=MSGS, tools=[tool], max_tokens=60, temperature=1.0,
                             seed=8, tool_choice={"type": "function", "function": {"name": "record_person"}})
        (call,) = parsed.choices[0].message.tool_calls
        assert isinstance(call.function.parsed_arguments, Person)

    run_app(state, scenario)


def test_http_structured_fields_and_refusals(state):
    async def scenario(http, client):
        schema = SCHEMAS["enum"]
        bodies = [
            {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}},
            {"guided_json": schema}, {"guided_json": json.dumps(schema)},
            {"structured_outputs": {"json": schema}},
        ]
        for extra in bodies:
            for route, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MSGS})):
                r = await http.post(route, json={**base, "max_tokens": 40, **extra})
                assert r.status_code == 200, (route, extra, r.text)
                choice = r.json()["choices"][0]
                jsonschema.validate(json.loads(choice.get("text", choice.get("message", {}).get("content"))), schema)
        r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10, "guided_choice": ["on", "off"],
                                                     "n": 3, "temperature": 1.0, "stream": True})
        texts: dict[int, str] = {}
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
        assert sorted(texts) == [0, 1, 2] and set(texts.values()) <= {"on", "off"}
        for extra, param in [({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json"),
                             ({"guided_regex": "[a-"}, "guided_regex"),
                             ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
                             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                                 "type": "object", "required": 3}}}}, "response_format.json_schema.schema"),
                             ({"foo_bar": 1}, "foo_bar")]:
            r = await http.post("/v1/chat/completions", json={"messages": MSGS, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
        spec = (await http.get("/openapi.json")).json()
        chat = json.dumps(spec["paths"]["/v1/chat/completions"])
        assert all(k in chat for k in ("response_format", "json_schema", "tool_choice", "guided_regex",
                                       "structured_outputs", "parallel_tool_calls"))

    run_app(state, scenario)


def test_default_model_json_schema(default_llm):
    gemma = default_llm
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**8},
                                               "capital": {"type": "boolean"}},
              "required": ["city", "population", "capital"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=40, temperature=t, seed=1, constraint=Constraint.json_schema(schema))
              for t in (0.0, 0.7)]
    outs = gemma.generate(["Describe Paris as JSON:", "Describe Oslo as JSON:"], params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    choice = gemma.generate(["Is the sky blue? Answer:"], SamplingParams(
        max_tokens=8, temperature=0, constraint=Constraint.choice(["yes", "no"])))[0]
    assert choice.text in ("yes", "no")
