"""`python -m sglang.launch_server` on the rehearsal's SGLang image: the stand-in server, same flags."""

from harness.sglang_standin import main

if __name__ == "__main__":
    main()
