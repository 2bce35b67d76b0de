"""Worker-side activation code: hook points and the extraction engine (no Django imports)."""
