from luftpause.cli import main

main()
