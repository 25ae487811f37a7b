"""Which weights a path stands for (``weight_sets``: a directory's sets compared), which entry of a torch
file holds them (``entries``), and how their names become the module's (``resolve``: the one resolver
every face asks)."""
