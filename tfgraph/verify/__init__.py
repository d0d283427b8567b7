"""Verify: every artifact against eager PyTorch — parity of one forward pass, of a cached
prefill and decode, of greedy generation; the rules of each precision; re-checking an
existing artifact and bisecting a failure to its module."""
