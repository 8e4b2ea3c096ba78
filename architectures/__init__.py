"""First-party plugins (mapped to infer.<this folder>); see infer.hookspecs."""
