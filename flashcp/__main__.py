from flashcp.cli import main

if __name__ == "__main__":  # worker processes started with "spawn" import this module too
    main()
