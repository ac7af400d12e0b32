"""Layer 3 — node memory: the tmpfs store (segments, headers published last, free pool,
retention, preflight), staging copies into segments, checksums. Imports ``errors`` only."""
