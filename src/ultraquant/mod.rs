//! UltraQuant FP4 KV-cache format (filled in by the format work).
