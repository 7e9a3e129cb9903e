"""The operator's console (``llmgw console``) and the node console
(``llmgw console --node``): full-screen prompt-toolkit programs, each a
process of its own. The console speaks only to the admin API with the admin
token; the node console only to the agent's status socket. What they show
and the keys they take are in ``docs/console.md``."""
