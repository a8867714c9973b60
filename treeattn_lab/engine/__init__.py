"""How to run a rollout trie through a model: DFS materialization, micro-batching, cost model and fallback."""
