"""The driver: plans shards, prunes stale ones, starts Ray and fans tasks out, records telemetry."""
