"""The verbs: each public function validates its options, reads the source once, plans,
executes and commits. A verb imports services, never another verb's module."""
