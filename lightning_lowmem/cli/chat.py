"""``lightning-lowmem chat``: ``litgpt chat``'s own loop, with the model loaded by lightning_lowmem.

The conversation is litgpt 0.5.13's (``litgpt.chat.base.interact`` and
``process_prompt``, its prompt style lookup and ``prompt_style.stop_tokens``);
only the load differs: the model is streamed in (quantized on load, on CPU too),
and :func:`~lightning_lowmem.litgpt.patch.patch_litgpt` makes litgpt's
``set_kv_cache`` size the caches to each request, in the model's dtype, with the
RoPE tables in the dtype ``generate`` computes them in (the model is marked with it
at load: :func:`~lightning_lowmem.litgpt.rope.pin_generation_rope_dtype`), so each
reply is the tokens ``generate`` gives for that prompt.
"""

from __future__ import annotations

import argparse
import builtins
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_lowmem.cli.exits import EXIT_OK, exit_codes
from lightning_lowmem.cli.options import (
    CHECKPOINT_HELP,
    add_checkpoint,
    add_compile,
    add_load,
    add_sampling,
    add_subcommand,
    check_budgets,
    config_argument,
    default_device,
)
from lightning_lowmem.litgpt.requirement import import_litgpt

SEED = 1234  # litgpt chat's L.seed_everything(1234)

EPILOG = """example:
  lightning-lowmem chat checkpoints/meta-llama/Llama-3.2-1B-Instruct --quantize bnb.nf4
  printf 'What do llamas eat?\\n\\n' | lightning-lowmem chat my-model --top_k 1   # scripted

""" + exit_codes("chat")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_subcommand(
        subparsers, "chat", summary="chat with a model, as litgpt chat does, with the model streamed in",
        description="Chat with a model, as `litgpt chat` does (its own loop and prompt styles, the same flags), "
                    "with the model streamed in and quantized as it loads, and the KV caches sized to each "
                    "request. An empty prompt ends the chat (with --multiline: '!submit' ends a prompt, "
                    "'!quit' the chat). Needs a tokenizer in the directory.",
        epilog=EPILOG)
    add_checkpoint(parser, CHECKPOINT_HELP)
    add_sampling(parser)
    add_load(parser)
    add_compile(parser)
    parser.add_argument("--multiline", action="store_true", help="prompts of several lines, ended by '!submit'")
    parser.set_defaults(run=run, parser=parser)


@dataclass
class Console:
    """What litgpt's chat loop asks of its ``Fabric``: the device, and ``print`` (one process: always printed)."""

    device: Any

    def print(self, *args: Any, **kwargs: Any) -> None:
        builtins.print(*args, **kwargs)


def run(args: argparse.Namespace) -> int:
    """Load, then run litgpt's chat loop until an empty prompt or end of input."""
    import torch
    interact = import_litgpt("litgpt.chat.base", needed_by="lightning-lowmem chat").interact

    from lightning_lowmem.litgpt.patch import patch_litgpt

    check_budgets(args, args.parser)
    model, tokenizer, found, report, device = _load(Path(args.checkpoint), args)
    config = found.config
    print(report, file=sys.stderr, flush=True)  # now, to a file or a pipe too (2> file), not at exit
    prompt_style = _prompt_style(found)
    exit_instruction = ("To exit, enter '!quit' or '!exit' on an empty prompt and press 'Enter'." if args.multiline
                        else "To exit, press 'Enter' on an empty prompt.")
    print(f"Now chatting with {config.name}.\n{exit_instruction}\n", flush=True)
    _seed()
    from lightning_lowmem.litgpt.kv_cache import unwrap_model
    from lightning_lowmem.memory.heap import handing_back_heap

    with patch_litgpt(), torch.inference_mode(), _decoding(args.compile, device, report), \
            handing_back_heap(unwrap_model(model)):  # as generate(): each step's freed transients out of RSS
        interact(multiline=args.multiline, model=model, tokenizer=tokenizer, prompt_style=prompt_style,
                 fabric=Console(device), temperature=args.temperature,
                 max_new_tokens=args.max_new_tokens, top_k=args.top_k, top_p=args.top_p,
                 stop_tokens=prompt_style.stop_tokens(tokenizer))
    if report.disk is not None:
        report.disk.close()
    return EXIT_OK


def _load(path: Path, args: argparse.Namespace) -> tuple[Any, Any, Any, Any, Any]:
    """``(model, tokenizer, what LitgptCheckpoint.find found, load report, the device it runs on)``; no tokenizer is
    an error before any weight is read."""
    from lightning_lowmem.request.defaults import execution_device
    from lightning_lowmem.errors import CheckpointNotFoundError
    from lightning_lowmem.litgpt.checkpoint_dir import LitgptCheckpoint
    from lightning_lowmem.litgpt.generation import generation_options, load_for_generation

    found = LitgptCheckpoint.find(path, config_argument(args.config), args.weights, verify=args.verify_weight_sets,
                                  entry=args.entry)
    if found.tokenizer is None:
        raise CheckpointNotFoundError(f"No tokenizer in {str(path)!r}: chat needs tokenizer.json or "
                                      "tokenizer.model there (or a GGUF file with a vocabulary). Copy the model's "
                                      "tokenizer files into the directory.")
    options = generation_options(None, args.precision, device=None if args.max_memory else default_device(args.device),
                                 quantize=args.quantize, max_memory=args.max_memory,
                                 disk_offload=args.disk_offload or None)
    model, tokenizer, report = load_for_generation(found, options=options)
    return model, tokenizer, found, report, execution_device(options)


def _decoding(compile: bool, device: Any, report: Any) -> Any:
    """With ``--compile``, litgpt's decode step compiled while the chat runs (each turn's caches sized to it)."""
    import contextlib

    from lightning_lowmem.litgpt.compiled import compile_blocker, compiled_decoding

    return compiled_decoding(device, blocked_by=compile_blocker(report)) if compile else contextlib.nullcontext()


def _prompt_style(found: Any) -> Any:
    """The directory's prompt style, a GGUF file's own chat template, or litgpt's for the config's name."""
    from lightning_lowmem.cli.prompts import prompt_style_for

    return prompt_style_for(found.directory, found.config, found.gguf, found.tokenizer,
                            f"{found.weights} (tokenizer.chat_template)")


def _seed() -> None:
    import lightning as L

    L.seed_everything(SEED, verbose=False)
