"""The prefix cache: one cache of idle prefixes over a context (:class:`~pyllama_kv.prefixcache.cache.PrefixCache`,
public as ``pk.PrefixCache``), its token trie, and the tiers it pages evicted prefixes out to (host
memory within a byte budget, and checked files on disk) with their counters.

May import: ``core``, ``config``, ``limits``, ``errors``. Imported by ``engine`` and the CLI."""
