"""KV chunk stores behind one small contract (``KVStore``), and the spec parser."""
from engine.kv_transfer.stores.base import ChunkFormat, KVStore
from engine.kv_transfer.stores.spec import parse_store_spec

__all__ = ["ChunkFormat", "KVStore", "parse_store_spec"]
