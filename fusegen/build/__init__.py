"""Build: cache keys, compilation into the private cache, loading; the request index."""
