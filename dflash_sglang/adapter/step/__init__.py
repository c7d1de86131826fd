"""A decode step: the spec-v2 worker SGLang's scheduler drives (`worker.DFlashWorker`) and what each step calls.

Per step, in every scheduler process: the shape (`shapes`: the goodput controller or a static table), the draft pass
(draft/), the target verify and acceptance (`verify`; trees: `tree`, `tree_attention`), then what the committed tokens
carry (`logprobs`, `penalties`, `hidden`, a hybrid target's recurrent state in `hybrid`), the controller's metrics
(`metrics`), and the torch stand-ins of SGLang's GPU-only helpers on CPU (`cpu`). Reads the settings start-up resolved;
imports draft/ and scale/, never boot/.
"""
