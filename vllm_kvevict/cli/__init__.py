"""The ``vllm-kvevict`` command-line tool."""
