"""``tfgraph run PATH``: run an artifact on token ids (and ``--inputs FILE.npz``)."""

from __future__ import annotations

from tfgraph.cli.output import table
from tfgraph.errors import TfgraphError, first_line


def add_parser(sub):
    p = sub.add_parser("run", help="run an artifact on token ids with ONNX Runtime")
    p.add_argument("path", help="artifact directory or .onnx file")
    p.add_argument("--input-ids", help='token ids, e.g. "1 2 3"')
    p.add_argument("--decoder-input-ids", help="decoder token ids (encoder-decoder models)")
    p.add_argument(
        "--inputs",
        metavar="FILE.npz",
        help="inputs that are not token ids (input_features, pixel_values …), named by input",
    )
    p.add_argument(
        "--provider",
        action="append",
        default=None,
        help="cpu (default), cuda or tensorrt; repeat for a fallback order",
    )
    p.add_argument("--save", metavar="FILE.npz", help="save all outputs")
    p.set_defaults(func=run)


def parse_ids(text: str, flag: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError as exc:
        raise TfgraphError(f"{flag} must be integers separated by spaces, got '{text}'") from exc
    if not ids:
        raise TfgraphError(f"{flag} is empty; give at least one token id")
    return ids


def load_inputs(path: str | None, *signatures) -> dict:
    """``--inputs FILE.npz``: arrays named by the inputs of the artifact's graphs (speech
    features, pixel values …), checked against their dtypes and ranks."""
    import numpy as np

    if path is None:
        return {}
    try:
        with np.load(path) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as exc:
        raise TfgraphError(f"cannot read --inputs '{path}': {first_line(exc)}") from exc
    ports = {}
    for signature in signatures:
        if signature is None:
            continue
        signature = getattr(signature, "signature", signature)  # a runner, or its signature
        ports.update({p.name: p for p in signature.inputs})
    for name, value in arrays.items():
        port = ports.get(name)
        if port is None:
            raise TfgraphError(
                f"--inputs '{path}' has '{name}', which is not an input of the model (inputs: "
                f"{', '.join(ports)})"
            )
        if port.shape is not None and value.ndim != len(port.shape):
            raise TfgraphError(
                f"--inputs '{name}' has rank {value.ndim}; the model takes {list(port.shape)}"
            )
        want = np.float32 if (port.dtype or "float").startswith("float") else np.int64
        if np.dtype(value.dtype).kind != np.dtype(want).kind:
            raise TfgraphError(f"--inputs '{name}' is {value.dtype}; the model takes {port.dtype}")
        arrays[name] = value.astype(want)
    if not arrays:
        raise TfgraphError(f"--inputs '{path}' holds no arrays")
    return arrays


def run(args) -> int:
    import numpy as np

    from tfgraph import contract
    from tfgraph.runtime import open_runner

    session = open_runner(args.path, providers=args.provider)
    signature = session.signature
    feeds = load_inputs(args.inputs, signature)
    batch = next(iter(feeds.values())).shape[0] if feeds else 1
    # encoder-decoder: --input-ids (or --inputs) feed the encoder, the decoder's tokens come
    # from --decoder-input-ids (default "0")
    seq2seq = signature.input(contract.ENCODER_TOKEN_IDS) is not None or (
        args.decoder_input_ids is not None
    )

    def ids_of(text: str | None, flag: str) -> np.ndarray | None:
        return None if text is None else np.array([parse_ids(text, flag)] * batch, np.int64)

    ids = ids_of(args.input_ids, "--input-ids")
    tokens = ids_of(args.decoder_input_ids or "0", "--decoder-input-ids") if seq2seq else ids
    for port in signature.inputs:
        if port.role in (contract.TOKEN_IDS, contract.ENCODER_TOKEN_IDS) and port.name not in feeds:
            if (tokens if port.role == contract.TOKEN_IDS else ids) is None:
                raise TfgraphError(
                    'give the tokens: --input-ids "1 2 3" (an encoder-decoder: also '
                    "--decoder-input-ids)"
                )
    for port in signature.inputs:
        if port.name in feeds:
            continue
        if port.role == contract.TOKEN_IDS:
            feeds[port.name] = tokens
        elif port.role == contract.ENCODER_TOKEN_IDS:
            feeds[port.name] = ids
        elif port.role == contract.ATTENTION_MASK:
            feeds[port.name] = np.ones_like(tokens)
        elif port.role in (contract.ENCODER_ATTENTION_MASK, contract.ENCODER_SLOT_MASK):
            feeds[port.name] = np.ones_like(ids)
        elif port.role == contract.PAST_LENGTH:  # a shared-buffer cached artifact
            feeds[port.name] = np.zeros(1, np.int64)
        elif port.role == contract.PAST_LENGTHS:  # each row's past length
            feeds[port.name] = np.zeros(batch, np.int64)
        elif port.role in (contract.PAST_KEY, contract.PAST_VALUE, contract.PAST_TOKENS):
            feeds[port.name] = np.zeros((batch, port.shape[1], 0, port.shape[3]), np.float32)
        elif port.role in contract.STATE_ROLES:  # a recurrent state before the first step
            feeds[port.name] = np.zeros((batch, *port.shape[1:]), np.float32)
        else:
            raise TfgraphError(
                f"the model takes input '{port.name}', which `run` cannot fill: give it with "
                "--inputs FILE.npz (arrays named by input)"
            )
    outputs = session.run(feeds)
    rows = []
    for name, value in outputs.items():
        row = [name, str(value.dtype), str(tuple(value.shape))]
        port = next((p for p in signature.outputs if p.name == name), None)
        if value.ndim == 3 and port is not None and port.role == contract.LOGITS:
            # (B, T, vocab): the next-token prediction of the last position
            last = value[0, -1]
            top = np.argsort(last)[::-1][:5]
            row.append("next token top-5: " + " ".join(f"{t}({last[t]:.2f})" for t in top))
        else:
            row.append(np.array2string(value.reshape(-1)[:6], precision=4))
        rows.append(row)
    print(table(rows, ["output", "dtype", "shape", "values"]))
    if args.save:
        try:
            np.savez(args.save, **outputs)
        except OSError as exc:
            raise TfgraphError(f"cannot save outputs to '{args.save}': {exc.strerror}") from exc
        print(f"saved outputs to {args.save}")
    return 0
