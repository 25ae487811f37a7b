"""The command line: ``lightning-lowmem`` (or ``python -m lightning_lowmem``) and its subcommands.

::

    estimate  the memory a load and a generation will need   (estimate.py)
    generate  litgpt generate, with the model streamed in     (generate.py)
    chat      litgpt chat, with the model streamed in         (chat.py)
    inspect   what a checkpoint holds, and whether it fits    (inspect_checkpoint.py)
    quantize  a pre-quantized copy, loaded as stored after    (quantize.py)

``commands.py`` builds the parser and turns errors into exit codes (``exits.py``);
``options.py`` holds the flags the subcommands share, spelled as litgpt spells them;
``prompts.py`` finds a directory's prompt style as litgpt does. Importing this package
imports neither litgpt nor Lightning: each subcommand imports them when it runs.
"""

from lightning_lowmem.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
