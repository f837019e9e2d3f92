"""Simulation inputs (pure): seeded global batches of sequence lengths for planner studies.

`megatron_hdp.sim.distributions` generates batches whose length mix follows published
dataset statistics (ByteScale's GitHub and Byted mixes) or the embedded stdlib corpus, with
an exact token budget; `describe` summarises a batch in the same terms.
"""
