"""Serving-engine integrations. Each subpackage imports its engine lazily: the rest of the
suite never needs it (`sglang`: the SGLang attention-backend plug-in)."""
