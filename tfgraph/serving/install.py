"""``python -m tfgraph.serving.install``: the Triton server's environment
(:mod:`tfgraph.runtime.serving.install`)."""

if __name__ == "__main__":
    from tfgraph.runtime.serving.install import main

    main()
