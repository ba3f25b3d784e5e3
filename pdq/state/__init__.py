"""State and the Redis protocol: the request, its end, every key and Lua script, the typed store, the worker
registry, Redis connections and URLs, the cancel listener."""
