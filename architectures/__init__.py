"""First-party plugins (mapped to infer.<this folder>); see infer.plugins.hookspecs."""
