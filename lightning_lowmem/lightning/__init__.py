"""The Lightning faces: ``Fabric(strategy="lowmem")`` (:mod:`.strategy`), ``Fabric(strategy="lowmem_fsdp")``
(:mod:`.fsdp`, and around its loads :mod:`.fsdp_load`), the Trainer's ``LowMemCallback`` (:mod:`.callback`),
the registration of both strategy names (:mod:`.registration`), how they load (:mod:`.load`) and the Lightning
state around a model on meta (:mod:`.state`).

Importing this package does not import Lightning; importing ``.strategy``, ``.fsdp`` or ``.callback`` does.
"""
