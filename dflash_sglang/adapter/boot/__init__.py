"""Start-up and admission: what runs before anything is served.

SGLang's `load_plugins()` calls `plugin.register` in every process; its hooks route `--speculative-algorithm DFLASH`
here. In the process that builds ServerArgs, once: our flags on SGLang's parser (`flags`), the refusals of what we
do not serve (`refusals`, `draft_checks`), the mode and verify shape (`mode`) and the resolution into the frozen
`DFlashSettings` the step reads (`resolve`). At admission, per request: `requests`. Nothing here runs per step.
May import step/, draft/, scale/ and the adapter's settings and versions; nothing below imports boot/.
"""
