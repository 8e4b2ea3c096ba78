"""Vision prefill on numpy against transformers float32: one 896-pixel image on Gemma 3 shapes.

A random Gemma 3 vision-language folder is built with transformers
(``Gemma3ForConditionalGeneration`` from a config, saved with its image
processor and a word-level tokenizer): the vision tower has SigLIP so400m's
shapes as Gemma 3 ships it (896 x 896 pixels, 14-pixel patches: 4,096
patches; width 1152, MLP 4304, 16 heads; 27 layers unless ``--vision-layers``
says fewer), the projector pools to 256 soft tokens of Gemma 3 4B's width
(2560); the language model has 4B's layer shapes (8 heads of 256, 4 KV heads,
MLP 10240) with ``--text-layers`` layers and a ``--vocab``-token vocabulary
(the real 34 layers and 262k tokens are 16 GB in float32 per engine; the
head runs for the last token only, so the vocabulary barely moves the time).

Both engines run in this process, interleaved, ``--repeats`` times each;
the figures are medians:

* **images/s**: one preprocessed image through the tower and projector
  (infer: the network's ``embed_image``; transformers: ``get_image_features``);
* **time to first token**: from the PIL image and the prompt text to the
  first greedy token: preprocessing, the tower, the prompt's prefill
  (256 image tokens and the text around them) and the head.

infer runs on its numpy backend in float32 (``infer.load(..., backend="numpy",
dtype="float32")``), transformers on torch's CPU in float32, each with
``--threads`` threads.

Usage: ``python benchmarks/vision.py --vision-layers 4 --text-layers 2 --repeats 3``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_image>", "<end_of_image>", "<image_soft_token>",
            "<start_of_turn>", "<end_of_turn>"]


def build(out: Path, vision_layers: int, text_layers: int, vocab: int) -> None:
    """The random folder (see the module docstring)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil,
                              Gemma3Processor, PreTrainedTokenizerFast)

    words = {t: i for i, t in enumerate(SPECIALS)}
    for i in range(vocab - len(words)):
        words[f"w{i}"] = len(words)
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    ids = {s: words[s] for s in SPECIALS}
    config = Gemma3Config(
        text_config=dict(vocab_size=vocab, hidden_size=2560, intermediate_size=10240, num_hidden_layers=text_layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                         sliding_window=1024, max_position_embeddings=8192,
                         layer_types=["full_attention" if i % 6 == 5 else "sliding_attention"
                                      for i in range(text_layers)],
                         bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"]),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                           num_hidden_layers=vision_layers, num_attention_heads=16, image_size=896, patch_size=14,
                           vision_use_head=False),
        mm_tokens_per_image=256, boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"], bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"])
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # the projector starts at zero: give it values so the image moves the logits
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 1152 ** -0.5)
    model.save_pretrained(out, safe_serialization=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>", extra_special_tokens={
                                       "image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                                       "eoi_token": "<end_of_image>"})
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 896, "width": 896}),
                                tokenizer=fast, image_seq_length=256)
    processor.save_pretrained(out)


def picture() -> Any:
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (600, 800, 3), dtype=np.uint8))  # resized to 896 x 896


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vision-layers", type=int, default=27)
    parser.add_argument("--text-layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--folder", type=Path, default=None, help="where to build the model (default: a temp folder)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()

    import torch
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    import infer

    torch.set_num_threads(args.threads)
    folder = args.folder or Path(tempfile.mkdtemp(prefix="infer-vision-bench-"))
    if not (folder / "config.json").exists():
        start = time.perf_counter()
        build(folder, args.vision_layers, args.text_layers, args.vocab)
        print(f"built {folder} in {time.perf_counter() - start:.0f} s")
    image = picture()
    text = "<start_of_image> " + " ".join(f"w{i}" for i in range(16))

    ours = infer.load(folder, backend="numpy", dtype="float32")
    ops, network = ours.backend, ours.engine.model
    ids, media = ours.image_prompt(text, [image])
    pixels, meta = media.images[0].processed.pixel_values, media.images[0].processed.meta
    processor = AutoProcessor.from_pretrained(folder)
    ref = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    inputs = processor(text=text, images=[image], return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == ids, "the two engines' prompts differ"

    def infer_image() -> None:
        ops.to_numpy(network.embed_image(ops.from_numpy(pixels), meta))

    def hf_image() -> None:
        with torch.no_grad():
            ref.get_image_features(pixel_values=inputs["pixel_values"])

    def infer_first() -> int:
        return ours.complete(text, images=[image], max_tokens=1, temperature=0).token_ids[0]

    def hf_first() -> int:
        with torch.no_grad():
            got = processor(text=text, images=[image], return_tensors="pt")
            return int(ref(**got, logits_to_keep=1).logits[0, -1].argmax())

    runs: dict[str, list[float]] = {name: [] for name in ("infer image", "hf image", "infer ttft", "hf ttft")}
    firsts = set()
    for _ in range(args.repeats):
        for name, fn in (("infer image", infer_image), ("hf image", hf_image), ("infer ttft", infer_first),
                         ("hf ttft", hf_first)):
            start = time.perf_counter()
            out = fn()
            runs[name].append(time.perf_counter() - start)
            if out is not None:
                firsts.add(out)
            print(f"{name}: {runs[name][-1]:.2f} s", flush=True)
    med = {name: statistics.median(v) for name, v in runs.items()}
    config = json.loads((folder / "config.json").read_text())  # the folder's own sizes (it may be an older build)
    result = {
        "vision_layers": config["vision_config"]["num_hidden_layers"],
        "text_layers": config["text_config"]["num_hidden_layers"], "vocab": config["text_config"]["vocab_size"],
        "prompt_tokens": len(ids), "repeats": args.repeats, "threads": args.threads,
        "infer_images_per_s": 1 / med["infer image"], "hf_images_per_s": 1 / med["hf image"],
        "infer_ttft_s": med["infer ttft"], "hf_ttft_s": med["hf ttft"],
        "image_ratio": med["hf image"] / med["infer image"], "ttft_ratio": med["hf ttft"] / med["infer ttft"],
        "same_first_token": len(firsts) == 1, "runs": runs,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
