"""Record-shaped vision steps without vLLM (issue 23), on the tiny vision model (``vision_model_dir``,
tests/vision.py): two test images by digest, and steps sampled from the model itself with transformers
``generate`` (their raw logprobs taken from generate's logits, as vLLM records them)."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import torch

from steptap.learner.vision import VisionInputs
from steptap.middleware.records import ImageRef, Sampling, Step, Trajectory


def _png(w: int, h: int, color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    img = Image.new("RGB", (w, h), color)
    for x in range(0, w, 7):  # not flat: patches that differ
        for y in range(0, h, 5):
            img.putpixel((x, y), (x * 3 % 256, y * 5 % 256, (x + y) % 256))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


IMAGES = {hashlib.sha256(b).hexdigest(): b
          for b in (_png(60, 50, (200, 30, 40)), _png(40, 90, (10, 120, 220)))}
DIGESTS = list(IMAGES)


class Recorder:
    """Record-shaped vision steps from the model itself: prompts as vLLM expands them, a sampled response and
    its raw logprobs."""

    def __init__(self, vl_dir: Path) -> None:
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(vl_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
        self.inputs = VisionInputs(vl_dir, IMAGES.get)
        self.pad = self.inputs.image_token_id
        self.start, self.end = self.tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])

    def prompt(self, digests: list[str], text: str) -> list[int]:
        """The chat prompt with each image's pad token repeated per merged patch (vLLM's expansion)."""
        ids = self.tok.encode("<|im_start|>user\n")
        for d in digests:
            grid = self.inputs.processor(images=[_image(d)], return_tensors="pt")["image_grid_thw"][0]
            ids += [self.start] + [self.pad] * (int(grid.prod()) // self.inputs.merge ** 2) + [self.end]
        return ids + self.tok.encode(f"{text}<|im_end|>\n<|im_start|>assistant\n")

    @torch.no_grad()
    def step(self, index: int, digests: list[str], text: str, seed: int, images: bool = True) -> Step:
        """A sampled step; ``images=False``: what a text-only path records (the pad tokens seen as text)."""
        prompt = self.prompt(digests, text)
        ids = torch.tensor([prompt])
        extra = {}
        if images:
            pix = self.inputs.processor(images=[_image(d) for d in digests], return_tensors="pt")
            extra = {"pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"],
                     "mm_token_type_ids": self.inputs.token_types(ids)}
        torch.manual_seed(seed)
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                  temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=6, min_new_tokens=6,
                                  output_logits=True, return_dict_in_generate=True, pad_token_id=0, **extra)
        resp = out.sequences[0, len(prompt):]
        logits = torch.stack(out.logits, dim=1)[0].float()  # raw: before the sampler's warpers
        lps = torch.log_softmax(logits, -1).gather(-1, resp[:, None])[:, 0]
        return Step(index=index, prompt_token_ids=prompt, response_token_ids=resp.tolist(),
                    response_logprobs=lps.tolist(), sampling=Sampling(temperature=1.0),
                    images=[ImageRef(sha256=d, mime="image/png") for d in digests],
                    prefix="first" if index == 0 else "extends")


def _image(digest: str):  # type: ignore[no-untyped-def]
    from PIL import Image

    return Image.open(io.BytesIO(IMAGES[digest])).convert("RGB")


def trajectories(recorder: Recorder) -> list[Trajectory]:
    """Two groups of two trajectories: one image and a second call showing it again, or two images."""
    out = []
    for g in range(2):
        for m in range(2):
            first = recorder.step(0, DIGESTS[:1] if m == 0 else DIGESTS, f"look {g}", seed=10 * g + m)
            steps = [first]
            if m == 0:  # a second call in the same session showing the same image: never packed
                steps.append(recorder.step(1, DIGESTS[:1], f"look {g} again", seed=100 + g))
            out.append(Trajectory(id=f"t{g}{m}", group_id=f"g{g}", status="finished", steps=steps,
                                  rewards={"r": float(m + g)}))
    return out


def blind(recorder: Recorder) -> list[Trajectory]:
    """A step naming its image whose recorded logprobs were taken without it (the pad tokens read as text):
    what a learner that does not see the image as vLLM did would compute."""
    step = recorder.step(0, DIGESTS[:1], "look 0", seed=0, images=False)
    step.images = [ImageRef(sha256=DIGESTS[0])]
    return [Trajectory(id="b", group_id="gb", status="finished", steps=[step])]
