"""How each tensor of a load travels from the file into the module, and what it holds meanwhile: one route
per target (``choice``), the base class and the load's traits (``route``), what routes read with
(``reader``, ``readahead``, ``row_reads``), stacked tensors (``stacked``), the device path (``staging``,
``staged``) and the sharded tensors a rank reads whole (``whole_reads``)."""
