"""Speculative decoding: where drafts come from and how long they may be.

* ``drafts``: draft sources without a second model: :class:`~.drafts.PromptLookup` (a continuation's own
  prompt and output: what followed the earlier occurrence whose match extends furthest back) and
  :class:`~.drafts.SuffixIndex` (every conversation and answer the engine cached: a continuation seen
  before in any of them).
* ``policy``: the cost rule, :class:`~.policy.SpecPolicy`: what a decode of B tokens costs here
  (measured as the engine runs), how often each source's drafts are accepted, and from both how many
  draft tokens each continuation gets this step (none when speculation would not pay).

The engine (``engine/scheduler.py``) puts the drafts into its one decode, reads the logits of every
drafted position (``Context.decode(outputs=...)``), samples them in order with the continuation's
own sampler and keeps the drafted tokens up to the first one the sampler did not draw: so the output
is exactly what the engine gives without speculation (the same tokens for the same logits, at any
temperature and seed).

May import: ``core``, shared. Imported by ``engine``.
"""
