"""What a model directory says about how to serve it, read from its JSON files alone (no transformers): the
served name, the chat template, the tokenizer's tokens, and the tool-call parser that fits them."""

from __future__ import annotations

from pathlib import Path

from steptap.middleware.model_files import chat_template as chat_template  # X as X: one definition, kernel
from steptap.middleware.model_files import read_json as _read_json

# model_type -> vLLM tool-call parser. Qwen and other ChatML models emit hermes blocks (<tool_call>{json}).
TOOL_PARSERS: dict[str, str] = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "smollm3": "hermes",
    "llama": "llama3_json",
    "mistral": "mistral",
    "granite": "granite",
    "internlm2": "internlm",
    "jamba": "jamba",
}
# What each parser needs from the model, else vLLM refuses to start (llama3_json: "could not locate the bot
# token '<|python_tag|>' in the tokenizer"): (tokens the tokenizer must hold, strings the chat template must
# contain). hermes needs no dedicated token (it parses text), only a template that asks for <tool_call>.
PARSER_NEEDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "hermes": ((), ("<tool_call>",)),
    "llama3_json": (("<|python_tag|>",), ()),
    "mistral": (("[TOOL_CALLS]",), ()),
    "jamba": (("<tool_calls>", "</tool_calls>"), ()),
    "granite": ((), ("<|tool_call|>",)),
    "internlm": ((), ("<|action_start|>",)),
}
# ChatML's turn markers. A ChatML template that says nothing about tools (SmolLM2's) still belongs to the
# family whose tool convention is hermes: Hermes and Qwen write <tool_call>{json}</tool_call> inside a ChatML
# assistant turn, and models tuned on ChatML data answer a tools prompt in that form, not in Llama's.
CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")

def tokenizer_tokens(model_dir: Path) -> set[str] | None:
    """Every token string the tokenizer knows (vocabulary and added tokens), from its JSON files; None when
    the directory has no tokenizer these files describe (e.g. only a sentencepiece ``tokenizer.model``)."""
    tokens: set[str] = set()
    found = False
    tok = _read_json(model_dir / "tokenizer.json")
    if tok:
        found = True
        vocab = (tok.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            tokens.update(vocab)
        elif isinstance(vocab, list):  # unigram: [[piece, score], ...]
            tokens.update(v[0] for v in vocab if isinstance(v, list) and v)
        tokens.update(t.get("content", "") for t in tok.get("added_tokens") or () if isinstance(t, dict))
    added = _read_json(model_dir / "tokenizer_config.json").get("added_tokens_decoder")
    if isinstance(added, dict):
        found = True
        tokens.update(t.get("content", "") for t in added.values() if isinstance(t, dict))
    vocab_json = _read_json(model_dir / "vocab.json")
    if vocab_json:
        found = True
        tokens.update(vocab_json)
    return tokens if found else None


def _parser_fits(parser: str, template: str, tokens: set[str] | None) -> str | None:
    """Why ``parser`` cannot work with this model (None: it can)."""
    need_tokens, need_text = PARSER_NEEDS.get(parser, ((), ()))
    for t in need_tokens:
        if tokens is None and t not in template:
            return f"cannot check that the tokenizer holds {t!r}"
        if tokens is not None and t not in tokens:
            return f"the tokenizer has no {t!r} token"
    for t in need_text:
        if t not in template:
            return f"the chat template never mentions {t!r}"
    return None


def choose_tool_parser(model_dir: Path) -> tuple[str | None, str]:
    """The tool-call parser for a model, from what its chat template and tokenizer contain: the parser its
    ``model_type`` suggests when the tokens and markers it needs exist, else hermes when the template asks for
    ``<tool_call>`` blocks or is a ChatML template (turns framed by ``<|im_start|>``/``<|im_end|>`` tokens),
    else none. Returns ``(parser, why)``."""
    model_type = _read_json(model_dir / "config.json").get("model_type", "")
    template, tokens = chat_template(model_dir), tokenizer_tokens(model_dir)
    by_type = TOOL_PARSERS.get(model_type)
    reasons = []
    if by_type is not None:
        problem = _parser_fits(by_type, template, tokens)
        if problem is None:
            return by_type, f"{by_type} (model type {model_type})"
        reasons.append(f"not {by_type}: {problem}")
    if by_type != "hermes" and _parser_fits("hermes", template, tokens) is None:
        return "hermes", "hermes (the chat template asks for <tool_call> blocks)" + (
            f"; {reasons[0]}" if reasons else "")
    if _is_chatml(template, tokens):
        return "hermes", "hermes (a ChatML chat template: ChatML's tool-call convention)" + (
            f"; {reasons[0]}" if reasons else "")
    reasons.append("no known tool-call format in the chat template")
    return None, "; ".join(reasons)


def _is_chatml(template: str, tokens: set[str] | None) -> bool:
    """The template frames turns with ChatML's markers and the tokenizer holds them as tokens (a template that
    only mentions them in text is not enough when the tokenizer can be read)."""
    if not all(m in template for m in CHATML_MARKERS):
        return False
    return tokens is None or all(m in tokens for m in CHATML_MARKERS)


def pick_tool_parser(model_dir: Path) -> str | None:
    """The parser ``choose_tool_parser`` picks (None: start without tool calls)."""
    return choose_tool_parser(model_dir)[0]


def served_name(model_dir: Path) -> str:
    """The model's real name: `_name_or_path` when it is a hub id, else the directory's name."""
    name: str = _read_json(model_dir / "config.json").get("_name_or_path", "")
    if name and not Path(name).exists() and not name.startswith(("/", ".")):
        return name
    return model_dir.resolve().name
