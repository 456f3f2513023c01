"""How a run spreads over processes and devices: the process group and its collectives
(``distributed``) and FSDP2's sharding of a model (``fsdp``). The lowest engine room: every other
one may ask which rank it is or reach a model's local shard."""
