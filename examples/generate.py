"""Generate text with a litgpt model loaded by lightning_lowmem: ``lightning-lowmem generate`` as a script.

The flags are litgpt's (``litgpt generate``)::

    python examples/generate.py --checkpoint_dir checkpoints/EleutherAI/pythia-1b \\
        --prompt "What food do llamas eat?" --max_new_tokens 50 --quantize bnb.nf4

It is the same as ``lightning-lowmem generate ...`` (see ``--help`` and docs/cli.md):
the directory's prompt style is applied, the model is streamed in and quantized as it
loads, the KV caches are sized to prompt + max_new_tokens, and litgpt's own generate
loop runs. A directory without a tokenizer takes token ids: ``--prompt '1 2 3'``.
"""

from __future__ import annotations

import sys

from lightning_lowmem.cli import main

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]]))
