"""Attention over a sequence split across devices: Ulysses inside (sp), the ring across (cp).

The model calls one entry, `context.context_attention`, whenever mesh.cp or mesh.sp exceeds 1; the
data loader calls `zigzag.sequence_order` on the host. The files, from the outside in:

    context.py   the one shard_map region: q/k/v in sequence-sharded, Ulysses around the ring
    ulysses.py   sp: an all-to-all trades a sequence shard for a head shard, and back
    ring.py      cp: K/V blocks travel the ring (or are all-gathered once), partials merged by lse
    block.py     one (query block, key block) pair, forward and backward: what the ring schedules
    zigzag.py    which token positions each cp rank holds (pure numpy, applied to the batch on the host)

Nothing is imported here: the data loader's import of zigzag (pure numpy) pulls in no jax or kernels.
"""
