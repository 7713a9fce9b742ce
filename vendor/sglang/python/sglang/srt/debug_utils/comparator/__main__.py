from sglang.srt.debug_utils.comparator.entrypoint import main

if __name__ == "__main__":
    main()
