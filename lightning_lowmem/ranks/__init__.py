"""Many ranks (FSDP2): the device a collective takes (``collectives``), every rank failing together at the
end of each stage (``agreement``), this rank's parts allocated and filled in place (``shard_fill``) and
sums agreed across the ranks holding a weight's rows (``shard_sums``)."""
